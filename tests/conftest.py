import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch_ends import torch_python  # noqa: E402,F401  (the fixture: both ends of the torch range)
