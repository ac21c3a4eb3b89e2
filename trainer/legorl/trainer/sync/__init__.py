"""Weight sync: publishing a policy version and loading it into the fleet's engines (files or NCCL)."""
