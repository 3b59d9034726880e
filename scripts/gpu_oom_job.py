"""A training script that knows nothing of gpumem (run by scripts/gpu-check.sh with
GPUMEM_PUSH=1 in its environment): a few steps on the GPU, then an allocation far beyond the
device, and the process dies of torch.OutOfMemoryError, as a real job would.
"""

import torch

model = torch.nn.Linear(4096, 4096).cuda()
for _ in range(5):
    model(torch.randn(512, 4096, device="cuda")).sum().backward()
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
print(f"job: {torch.cuda.memory_reserved() >> 20} MiB reserved; asking for {2 * total >> 30} GiB",
      flush=True)
torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # raises: the job dies here
