"""Units that need no daemon process: the GGUF reader, tokenizer, planner, sampler, config, CLI, the rig's
dispatcher and transport choice, the package layering."""
