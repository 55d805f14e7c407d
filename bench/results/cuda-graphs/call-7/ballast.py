"""A pytest plugin (-p ballast): holds $BALLAST_MIB of CUDA memory for the whole session, as
memory another test left in the process would."""
import os

import torch

_held = torch.empty(int(os.environ.get("BALLAST_MIB", "0")) << 20, dtype=torch.uint8,
                    device="cuda") if torch.cuda.is_available() else None
