"""Glue between instant_staging's loader and the libraries that consume
weights (transformers; later vLLM).  Each integration is its own module and
imports its library only when used."""
