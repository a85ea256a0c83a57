"""The contract between the control plane and the data plane: where a shard set's files live,
the result a Job reports, every reason either plane can give, the engine arguments and the
size grammar both read. Both planes import it; it imports neither."""
