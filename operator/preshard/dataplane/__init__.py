"""The data plane: the commands that move model bytes, run inside Jobs and init containers.

`preshard serialize` makes a shard set, `verify` checks one, `fetch-config` copies its
non-weight files into a serving pod, `delete` removes one. Each ends with one `Outcome` in the
pod's termination message and the exit code of its reason. The modules here import boto3,
torch, tensorizer and vLLM lazily, so the operator image can import this package without them.
"""
