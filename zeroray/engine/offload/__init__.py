"""Offload: where the optimizer's masters and states live (``home``: the interface; ``resident``:
device or host memory; ``nvme``: swap files), the aligned swap-file I/O they share (``files``), and
the parameter shards parked in files at stage 3 (``param_files``)."""
