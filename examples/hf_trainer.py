"""BERT fine-tuning with the Hugging Face Trainer and tightfit: the lines marked "tightfit" are all it adds or changes."""
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

import tightfit  # tightfit (1/6)
from tightfit.integrations import hf  # tightfit (2/6)

# A small BERT built from a config, to run offline in seconds; yours: from_pretrained("bert-base-uncased", ...)
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                                 num_attention_heads=2, intermediate_size=128, num_labels=2))
ids = torch.randint(1, 1000, (64, 32))  # 64 tokenized texts of 32 tokens; yours: tokenizer(texts, padding=...)
train = [{"input_ids": ids[i], "attention_mask": torch.ones(32, dtype=torch.long), "labels": i % 2} for i in range(64)]

sample = {"input_ids": ids[:16], "attention_mask": torch.ones(16, 32, dtype=torch.long), "labels": torch.arange(16) % 2}
plan = tightfit.plan(model, sample, effective_batch=16, budget="4GiB")  # tightfit (3/6)
args = TrainingArguments(**hf.training_arguments(plan, output_dir="hf-out", max_steps=2, learning_rate=5e-5,  # tightfit (4/6)
                                                report_to=[], save_strategy="no"))  # was per_device_train_batch_size=16
trainer = Trainer(model=model, args=args, train_dataset=train,
                  callbacks=[hf.TightfitCallback(plan)])  # tightfit (5/6)
result = hf.train(trainer)  # tightfit (6/6): was trainer.train()
print(f"{result.global_step} steps, loss {result.training_loss:.3f}; plan: {plan.micro_batch} x "
      f"{plan.accumulation_steps}, {plan.precision}")
