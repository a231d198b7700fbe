"""What runs before any rank starts: the config's value and cross-field checks (``checks``),
the run's inputs (``inputs``: data, model, tokenizer, checkpoint paths) and the config CLI
(``cli``, run as ``python -m megatron_stare.config``)."""
