"""Stage 2, models: building and loading the networks (the small random-weight model and its tokenizer, the
vision-language model, pretrained checkpoints). May import: config."""
