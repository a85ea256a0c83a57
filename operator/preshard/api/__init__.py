"""The ShardedModel API: models, status, CRD generation."""
