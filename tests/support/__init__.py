"""What the tests share (never collected as tests): the process harness (``dist``), the small models
(``models``), the training recipe and its one loop (``recipe``), and the helpers of the checkpoint,
offload, pretrained, Ray, deployment, S3 and subprocess tests. Test files import from here, never
from one another."""
