"""The ranks as a group: the worker group the controller drives, its placement on the cluster, the
rank actors (one per rank, hosting the user's loop), their rendezvous, and the typed poll answer a
rank gives the group."""
