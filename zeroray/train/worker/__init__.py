"""What runs inside the user's training loop, in a rank: the typed session behind ``get_context``,
``prepare``, ``report``, the rank's half of checkpoints, snapshots and recovery points, and the
rank's Ray metrics. Nothing here imports the driver."""
