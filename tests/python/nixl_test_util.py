"""Shared pieces of the Python API tests (test_api.py, test_bounce_path.py):
the NIXL Python API import, test data and waits. Imported from the tests'
own folder (Python puts a script's folder first on its path)."""

import os
import sys
import time

BLOCK = 4096
TIMEOUT_S = float(os.environ.get("NIXL_BOUNCE_TEST_TIMEOUT_S", "60"))


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


try:
    import numpy as np
    from nixl_cu13._api import nixl_agent, nixl_agent_config  # noqa: F401 (re-exported)
except Exception as e:  # noqa: BLE001
    fail(f"cannot import the NIXL Python API (nixl_cu13._api): {e!r}; "
         f"PYTHONPATH={os.environ.get('PYTHONPATH')}")


def pattern(n, seed):
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def scattered(n, blocks, seed):
    """n distinct block offsets out of `blocks`, in random order."""
    return (np.random.default_rng(seed).permutation(blocks)[:n] * BLOCK).astype(np.int64)


def wait_xfer(agent, handle, what):
    state = agent.transfer(handle)
    deadline = time.monotonic() + TIMEOUT_S
    while state == "PROC":
        if time.monotonic() > deadline:
            fail(f"{what}: still in progress after {TIMEOUT_S} s")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        fail(f"{what}: transfer state {state}")


def wait_notif(agent, sender, msg, what):
    deadline = time.monotonic() + TIMEOUT_S
    while not agent.check_remote_xfer_done(sender, msg, tag_is_prefix=False):
        if time.monotonic() > deadline:
            fail(f"{what}: notification {msg!r} from {sender} not received in {TIMEOUT_S} s")
        time.sleep(0.0005)


def expect_equal(actual, expected, dst_offsets, what):
    if np.array_equal(actual, expected):
        return
    diff = np.flatnonzero(actual != expected)
    first = int(diff[0])
    inside = any(o <= first < o + BLOCK for o in dst_offsets)
    fail(f"{what}: {diff.size} byte(s) differ, first at offset {first} "
         f"({'inside' if inside else 'OUTSIDE'} the destination blocks): "
         f"got {actual[first]:#04x}, expected {expected[first]:#04x}")
