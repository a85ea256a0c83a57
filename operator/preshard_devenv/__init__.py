"""A local, real test environment: kube-apiserver, etcd, controllers, kwok and an S3 server.

Shared by the pytest fixtures, `make dev-cluster` and `make run`. Everything binds to
127.0.0.1 on free ports and every process started here is stopped by its own pid.
"""
