"""A pytest plugin (-p memwatch): after each test, what it left in the process: CUDA memory
after gc and empty_cache, the global switches a test could leave changed. One line per test
to $MEMWATCH."""
import gc, json, os

import torch


def pytest_runtest_teardown(item, nextitem):
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        row = {"test": item.nodeid, "allocated": torch.cuda.memory_allocated(),
               "reserved": torch.cuda.memory_reserved(),
               "tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
               "matmul_precision": torch.get_float32_matmul_precision(),
               "bf16_reduced": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
               "fp16_reduced": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
               "cudnn_benchmark": torch.backends.cudnn.benchmark, "deterministic": torch.are_deterministic_algorithms_enabled(),
               "sync_debug": torch.cuda.get_sync_debug_mode(),
               "sdp": [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                       torch.backends.cuda.math_sdp_enabled()],
               "fraction_cap": None}
        with open(os.environ.get("MEMWATCH", "memwatch.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
