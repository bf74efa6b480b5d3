"""Mixture-of-experts: router rules, expert stores."""
