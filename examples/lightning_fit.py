"""A Lightning classifier trained with tightfit: the lines marked "tightfit" are all it adds or changes."""
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import tightfit  # tightfit (1/5)
from tightfit.integrations.lightning import TightfitCallback, trainer_arguments  # tightfit (2/5)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)

    def loss(self, batch):  # the mean loss of a batch, outside training_step (which logs, as fit expects)
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 32), torch.randint(0, 4, (512,)))
module = Classifier()
plan = tightfit.plan(module, data[:64], effective_batch=64, budget="4GiB",  # tightfit (3/5)
                     loss=lambda m, b: m.loss(b))
trainer = L.Trainer(**trainer_arguments(plan, max_epochs=1, logger=False, enable_checkpointing=False,  # tightfit (4/5)
                                        enable_progress_bar=False), callbacks=[TightfitCallback(plan)])
trainer.fit(module, DataLoader(data, batch_size=plan.micro_batch, shuffle=True))  # tightfit (5/5): was batch_size=64
print(f"{trainer.global_step} optimizer steps; plan: {plan.micro_batch} x {plan.accumulation_steps}, {plan.precision}")
