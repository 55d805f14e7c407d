"""Your own PyTorch loop with tightfit: the four lines marked "tightfit" are all it adds."""
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

import tightfit  # tightfit (1/4)

torch.manual_seed(0)
x, y = torch.randn(512, 32), torch.randint(0, 4, (512,))
dataset = TensorDataset(x, y)
loader = DataLoader(dataset, batch_size=64, shuffle=True)  # 64 = the effective batch
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(model, batch):  # the mean loss of a batch (x, y), as your loop computes it
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


# from the dataset, not next(iter(loader)): that would draw from the shuffle's RNG and change the run
sample_batch = default_collate([dataset[i] for i in range(64)])  # tightfit (2/4)
plan = tightfit.plan(model, sample_batch, effective_batch=64, budget="4GiB", loss=loss_fn)  # tightfit (3/4)
step = tightfit.TrainStep(plan, model, optimizer, loss=loss_fn)  # tightfit (4/4)
for epoch in range(2):
    for batch in loader:
        out = step(batch)  # was: loss = loss_fn(model, batch); loss.backward(); optimizer.step(); optimizer.zero_grad()
    print(f"epoch {epoch}: loss {out.loss:.3f}, micro-batch {out.micro_batch} x {out.accumulation_steps}")
print(plan.reasons[0])
print(step.summary())
