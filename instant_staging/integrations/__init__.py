"""Glue between instant_staging's loader and the libraries that consume
weights: transformers (``transformers.py``) and vLLM (``vllm/``, a load
format).  Each integration is its own module and imports its library only
when used."""
