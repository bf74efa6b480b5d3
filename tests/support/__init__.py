"""Helpers the test areas share: tiny models (and their Hugging Face oracles), real daemon processes, a fake
daemon, GPU detection."""
