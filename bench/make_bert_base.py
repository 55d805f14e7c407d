"""Write a BERT-base folder (random weights, bert-base-uncased shape: 110M parameters) with the
shipped MiniLM's tokenizer (same 30,522-token uncased WordPiece vocabulary), for memory and
speed runs where the weights' values do not matter.

Usage: python3 bench/make_bert_base.py OUT_DIR [TOKENIZER_DIR]
"""

import sys

import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

out = sys.argv[1]
tok_dir = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None
if tok_dir is None:
    from tightfit.models import default_model_path
    tok_dir = default_model_path()
torch.manual_seed(0)
BertForSequenceClassification(BertConfig()).save_pretrained(out)
AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out)
