"""preshard: pre-shards large language models for vLLM with tensorizer, on Kubernetes."""

__version__ = "0.1.0"
