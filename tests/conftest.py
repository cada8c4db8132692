"""Suite-wide set-up: Triton kernels run under the interpreter where there is no GPU.

``TRITON_INTERPRET`` must be set before any kernel is defined (at import of
``pipeserve.kernels.*``), hence here, before any test module is collected.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
