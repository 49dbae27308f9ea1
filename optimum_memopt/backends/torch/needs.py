"""What the torch backend needs of torch: its version (`torch_problem`), asked before anything of the backend loads."""

from typing import Optional

import torch
from packaging import version

MIN_TORCH = "2.5"


def torch_problem() -> Optional[str]:
    """Why the torch backend cannot run with the torch installed, or None."""
    if version.parse(torch.__version__.split("+")[0]) < version.parse(MIN_TORCH):
        return (
            f"the torch backend needs torch >= {MIN_TORCH} (installed: {torch.__version__}); install the modern stack "
            f"with `pip install 'optimum-memopt[torch]'` (or `-c constraints-torch.txt`, see README)"
        )
    return None
