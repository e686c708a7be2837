"""What zeroray exports to Prometheus (through Ray's metrics) and the Grafana dashboard built from it.

``metrics`` names every metric once; the rank and controller exporters (``zeroray.train``) create
them from there, and ``dashboard`` builds "zeroray overview" from the same names, so a panel can only
query a metric that exists. Plain Python: importing this package imports neither Ray nor torch.
"""
