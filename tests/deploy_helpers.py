"""What the deployment files must agree on, shared by the KubeRay and the launcher tests."""

# Ray's health check, set on every head (the KubeRay manifests and the launcher YAMLs alike).
HEALTH_CHECK = {"RAY_health_check_period_ms": "5000", "RAY_health_check_timeout_ms": "10000",
                "RAY_health_check_failure_threshold": "6"}
NVME_PATH = "/mnt/nvme/zeroray"  # where the worker nodes' NVMe is mounted, for offload_*.nvme_path
