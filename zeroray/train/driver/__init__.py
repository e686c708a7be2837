"""What runs only in the driver, in the process that called ``ZeroTrainer.fit()``: the controller and
its states, callbacks and progress display, the scaling and failure policies, the run's lease and
directory, the cluster connection and the controller's metrics. Nothing here runs in a rank."""
