"""Glue between instant_staging's loader and the libraries that consume
weights: transformers (``transformers/``) and vLLM (``vllm/``, a load
format).  Each integration is its own package and imports its library only
when used; ``_whole.py`` is the rule both apply to hand a load's tensors
over whole or streamed."""
