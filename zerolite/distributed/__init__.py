"""torchrun: the ranks of a job, and one host copy of the weights per node."""
