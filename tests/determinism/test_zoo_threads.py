"""In portable mode a model of each family in the zoo trains the same weight bytes on 1, 2 and 3 threads, in
float32 and in bfloat16 (train.amp).

`determinism.num_threads: auto` takes the cores a process is given, and in portable mode follows the load
from epoch to epoch (tasks/determinism/threads.py), which is sound only if no op's bytes follow the count.
The products, convolutions and activations are the portable kernels' (tests/determinism/test_blas.py and
others check them op by op); this trains each family's real ops (normalizations, attention, pooling, the
optimiser) where ATen cut layer norm's and softmax's sums by thread (convnext, swin), in one process
started as a stage is.
"""

from __future__ import annotations

import json

import pytest

from tests.determinism.test_portable_escapes import ZOO
from tests.support.portable import run_script

RUNS = [*ZOO, ("swin_t", "fp32")]  # (model, precision): the escape test's zoo, bf16 (train.amp) included
SIZE, BATCH = 32, 4  # large enough that ATen's kernels share a layer's rows among threads
TRAINING = """
import copy, hashlib, json, sys
from tasks.determinism.bootstrap import start
start(0, 1, strict=True, cpu="portable")
import torch
import torch.nn.functional as F
from tasks.train.models import build_model

size, batch = int(sys.argv[2]), int(sys.argv[3])
generator = torch.Generator().manual_seed(0)
images = torch.rand(batch, 3, size, size, generator=generator)
labels = torch.randint(0, 10, (batch,), generator=generator)
report = {}
for name, amp in json.loads(sys.argv[1]):
    built = build_model(name, 10, [0.5] * 3, [0.25] * 3, [size, size])
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        torch.manual_seed(1)  # the same dropout in each run
        model = copy.deepcopy(built)
        optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        for _ in range(2):  # the second step starts from weights the first trained
            optimiser.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimiser.step()
        weights = b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())
        report.setdefault(f"{name} {amp}", []).append(hashlib.sha256(weights).hexdigest())
print(json.dumps(report))
"""


@pytest.mark.slow
def test_each_family_trains_the_same_bytes_on_1_2_and_3_threads() -> None:
    stdout = run_script(TRAINING, json.dumps(RUNS), str(SIZE), str(BATCH))
    report = json.loads(stdout.strip().splitlines()[-1])
    assert sorted(report) == sorted(f"{name} {amp}" for name, amp in RUNS)
    moved = {name: hashes for name, hashes in report.items() if len(set(hashes)) != 1}
    assert moved == {}, f"weights that followed the thread count (1, 2, 3 threads): {moved}"
