"""Faults a new user of the Python API finds (session 39): class ids that cross-entropy cannot take
reach it from the own-loop API and from a custom dataset."""

import re

import pytest
import torch

import tightfit
from conftest import params_of, assert_same_params, tiny_bert
from tightfit.errors import TightfitError

CLASS_IDS = "labels must be class ids in [0, 2) (the model's num_labels), or -100 to leave a sample out"


def _text_batch(labels):
    ids = torch.randint(1, 50, (len(labels), 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.mark.parametrize("bad, said", [(5, "sample 3 is labelled 5 (number the classes 0..1, or give the model "
                                            "num_labels=6)"),
                                       (-1, "sample 3 is labelled -1 (number the classes 0..1)")])
def test_the_own_loop_refuses_class_ids_past_a_classifiers_labels_before_the_step(bad, said):
    """tightfit.plan and TrainStep with a Hugging Face classifier's own loss passed labels past its
    num_labels to cross-entropy: torch's "IndexError: Target 5 is out of bounds" on the CPU, a
    device-side assert on a GPU, which ends the CUDA context (nothing after it runs). The Trainer's
    workloads refused them on the host; the own loop now does too, before any forward."""
    model = tiny_bert()
    labels = torch.tensor([0, 1, 0, bad, 1, 0, 1, 0])
    with pytest.raises(TightfitError, match=re.escape(f"{CLASS_IDS}; {said}")):
        tightfit.plan(model, _text_batch(labels), effective_batch=8, device="cpu")
    plan = tightfit.plan(model, _text_batch(torch.arange(8) % 2), effective_batch=8, device="cpu")
    step = tightfit.TrainStep(plan, model)
    before = params_of(model)
    with pytest.raises(TightfitError, match=re.escape(f"{CLASS_IDS}; {said}")):
        step(_text_batch(labels))
    assert_same_params(before, params_of(model))
    assert step.steps == 0
    # -100 leaves a sample out and stays allowed; a good batch trains after the refusal
    assert step(_text_batch(torch.tensor([0, 1, -100, 1, 0, 0, 1, 1]))).stepped


def test_a_negative_class_id_is_refused_for_a_model_of_unknown_classes():
    """A custom dataset labelled -1 (not -100) for a plain module, whose classes tightfit cannot
    read from a config, passed the Workload's label check and failed at the step of fit() that
    met it ("IndexError: Target -1 is out of bounds"; on a GPU a device-side assert that ends the
    CUDA context, no checkpoint after it): no model takes a negative class id but -100."""
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from tightfit.plan import Plan
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.tasks import ImageClassification
    from tightfit.workload import Workload, collate_as

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 3)

        def forward(self, pixel_values, labels=None):
            return SimpleNamespace(logits=self.fc(pixel_values))

    x, y = torch.randn(40, 8), torch.arange(40) % 3
    refused = "or -100 to leave a sample out; sample 30 is labelled -1"
    with pytest.raises(TightfitError, match=re.escape(refused)):
        Workload(Plain(), TensorDataset(x, torch.where(torch.arange(40) == 30, -1, y)), None, 8,
                 task=ImageClassification(), collate_fn=collate_as("pixel_values", "labels"))

    class OneByOne(torch.utils.data.Dataset):  # read sample by sample: refused when its batch is collated
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return x[i], torch.tensor(-1 if i == 30 else int(y[i]))

    w = Workload(Plain(), OneByOne(), None, 8, task=ImageClassification(),
                 collate_fn=collate_as("pixel_values", "labels"))
    with pytest.raises(TightfitError, match=re.escape(refused)):
        Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1), progress=False).fit()
    # -100 leaves a sample out; labels past the classes of a model whose logits' width cannot be
    # found (its forward reads a value: no meta forward) are not refused
    class ReadsValues(Plain):
        def forward(self, pixel_values, labels=None):
            return SimpleNamespace(logits=self.fc(pixel_values) * float(pixel_values.abs().max() > 0))

    Workload(ReadsValues(), TensorDataset(x, torch.where(torch.arange(40) == 30, -100, y + 1)), None, 8,
             task=ImageClassification(), collate_fn=collate_as("pixel_values", "labels"))


def test_class_ids_past_a_plain_modules_logits_are_refused_when_the_workload_is_made():
    """A plain module's classes were unknown, so a label past its logits passed the Workload's
    check and failed at the first step (IndexError on the CPU; on a GPU a device-side assert that
    ends the CUDA context): the logits' width is found by a forward on meta tensors."""
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from tightfit.tasks import ImageClassification
    from tightfit.workload import Workload, collate_as

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 3)

        def forward(self, pixel_values):
            return SimpleNamespace(logits=self.fc(pixel_values))

    model = Plain()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(16, 8), torch.arange(16) % 3
    refused = ("labels must be class ids in [0, 3) (the model's logits have 3), or -100 to leave a sample out; "
               "sample 5 is labelled 7 (number the classes 0..2, or give the model a head of 8 outputs)")
    with pytest.raises(TightfitError, match=re.escape(refused)):
        Workload(model, TensorDataset(x, torch.where(torch.arange(16) == 5, 7, y)), None, 8,
                 task=ImageClassification(), collate_fn=collate_as("pixel_values", "labels"))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(TightfitError, match=r"^the evaluation data: ImageClassification: labels must be class ids"):
        Workload(model, TensorDataset(x, y), TensorDataset(x, torch.where(torch.arange(16) == 5, 7, y)), 8,
                 task=ImageClassification(), collate_fn=collate_as("pixel_values", "labels"))
    seen = []
    model.fc.register_forward_hook(lambda m, a, out: seen.append(out))  # the owner's hook sees no meta forward
    Workload(model, TensorDataset(x, y), None, 8, task=ImageClassification(),
             collate_fn=collate_as("pixel_values", "labels"))
    assert seen == []

    class Pointer(torch.nn.Module):  # one logit per position: its width follows the input, no class count
        def __init__(self):
            super().__init__()
            self.score = torch.nn.Linear(1, 1)

        def forward(self, pixel_values):
            return SimpleNamespace(logits=self.score(pixel_values.unsqueeze(-1)).squeeze(-1))

    Workload(Pointer(), TensorDataset(x, torch.where(torch.arange(16) == 5, 11, y)), None, 8,  # 11 > its 8 positions
             task=ImageClassification(), collate_fn=collate_as("pixel_values", "labels"))


class _NotATensor:
    def __reduce__(self):
        return (print, ("unpickled",))


def test_a_state_file_holding_code_is_refused_in_one_plain_line(tmp_path):
    """A checkpoint's state.pt (its manifest rewritten to match) or an export's model_int8.pt that
    holds a pickled function was refused by torch.load(weights_only=True) as it should be, but the
    one line shown was the first of torch's: terminal escape codes around "do those steps only if
    you trust the source", "you have two options" without the options, and not what was refused."""
    from tightfit.runtime.checkpoint import read_state

    (tmp_path / "ckpt-2").mkdir()
    torch.save({"step": 2, "evil": _NotATensor()}, tmp_path / "ckpt-2" / "state.pt")
    with pytest.raises(TightfitError) as info:
        read_state(tmp_path / "ckpt-2")
    message = str(info.value)
    assert "\n" not in message and "\x1b" not in message and "two options" not in message, message
    assert message.startswith("checkpoint ckpt-2 is corrupt (state.pt: cannot be loaded: it holds something "
                              "torch.load(weights_only=True) refuses to run: Unsupported global: GLOBAL print"), message
    from tightfit.export import WEIGHTS_FILE, load_int8

    export = tmp_path / "int8"
    tiny_bert().config.save_pretrained(export)
    torch.save({"evil": _NotATensor()}, export / WEIGHTS_FILE)
    with pytest.raises(TightfitError) as info:
        load_int8(export)
    message = str(info.value)
    assert "\n" not in message and "\x1b" not in message and "two options" not in message, message
    assert "refuses to run: Unsupported global: GLOBAL print" in message, message


def test_a_state_file_cut_to_nothing_names_the_error_not_str(tmp_path):
    """torch.load of an empty file raises EOFError with no message; the plain line for it named the
    type of the text it was given ("cannot be loaded: str"), not the error's."""
    from tightfit.export import WEIGHTS_FILE, load_int8
    from tightfit.runtime.checkpoint import read_state

    (tmp_path / "ckpt-2").mkdir()
    (tmp_path / "ckpt-2" / "state.pt").write_bytes(b"")
    with pytest.raises(TightfitError) as info:
        read_state(tmp_path / "ckpt-2")
    assert str(info.value) == "checkpoint ckpt-2 is corrupt (state.pt: cannot be loaded: EOFError)", str(info.value)
    export = tmp_path / "int8"
    tiny_bert().config.save_pretrained(export)
    (export / WEIGHTS_FILE).write_bytes(b"")
    with pytest.raises(TightfitError) as info:
        load_int8(export)
    assert "str)" not in str(info.value), str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.bool, torch.int32])
def test_class_ids_of_another_dtype_than_int64_are_refused_before_any_forward_and_leave_the_model_as_it_was(dtype):
    """From a fresh user's trial: float labels [B] (as read from pandas) for a Hugging Face
    classifier of 2 classes reached its forward, which read them as multi-label targets, failed
    with "Target size (torch.Size([2])) must be the same as input size" (the size of tightfit's
    check batch) and kept problem_type "multi_label_classification" in the config, so the same
    call with int64 labels then failed too. A review found uint8 and bool labels do the same, and
    int32 ones fail in cross-entropy ("expected target dtype to be Long or Byte"). Each is refused
    in one line before any forward, and the model stays as it was."""
    model = tiny_bert()
    said = (f"labels must be class ids, int64 [B] (the model has num_labels=2); the batch's are "
            f"{str(dtype).removeprefix('torch.')} [B]: give labels.long()")
    with pytest.raises(TightfitError, match=re.escape(said)):
        tightfit.plan(model, _text_batch((torch.arange(8) % 2).to(dtype)), effective_batch=8, device="cpu")
    assert model.config.problem_type is None
    plan = tightfit.plan(model, _text_batch(torch.arange(8) % 2), effective_batch=8, device="cpu")
    step = tightfit.TrainStep(plan, model)
    with pytest.raises(TightfitError, match=re.escape(said)):
        step(_text_batch((torch.arange(8) % 2).to(dtype)))
    assert step(_text_batch(torch.arange(8) % 2)).stepped


def test_a_dataloader_or_an_iterator_given_as_the_data_is_refused_in_one_line():
    """From a fresh user's trial: a DataLoader given as a Workload's data failed with "TypeError:
    'DataLoader' object is not subscriptable", an iterator with "object of type 'iterator' has no
    len()". Each is refused in one line naming what to give instead."""
    from torch.utils.data import DataLoader, TensorDataset

    from tightfit.tasks import ImageClassification
    from tightfit.workload import Workload, collate_as

    ds = TensorDataset(torch.randn(40, 8), torch.arange(40) % 3)

    def make(data):
        return Workload(torch.nn.Linear(8, 3), data, None, 8, task=ImageClassification(),
                        collate_fn=collate_as("pixel_values", "labels"))

    with pytest.raises(TightfitError, match=re.escape("the data is a DataLoader: give its dataset (loader.dataset)")):
        make(DataLoader(ds, batch_size=4))
    for data in (iter(ds), (s for s in ds)):
        with pytest.raises(TightfitError, match=r"the data must be a map-style dataset \(len\(\) and data\[i\].*, got "
                                                r"(iterator|generator)"):
            make(data)
    assert len(make(ds).train) == 40


def test_a_model_with_no_parameters_is_told_so_and_tensors_outside_a_frozen_model_still_train():
    """From a fresh user's trial: TrainStep refused a model with no parameters (nn.ReLU) saying
    every parameter had requires_grad=False. It now says the model has none. A review of the first
    fix (plan refused such models) found it refused a use that works: a frozen model and a loss
    that trains a tensor outside it through the optimizer given to TrainStep (a prompt)."""
    batch = {"x": torch.randn(4, 3), "y": torch.randn(4, 3)}
    loss = lambda model, b: ((model(b["x"]) - b["y"]) ** 2).mean()  # noqa: E731
    plan = tightfit.plan(torch.nn.ReLU(), batch, loss=loss, device="cpu")
    with pytest.raises(TightfitError, match=re.escape("TrainStep: the model has no parameters (ReLU): give optimizer= "
                                                      "over the tensors to train")):
        tightfit.TrainStep(plan, torch.nn.ReLU(), loss=loss)
    frozen = torch.nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(TightfitError, match=re.escape("TrainStep: the model has no trainable parameters (every one has "
                                                      "requires_grad=False); unfreeze the ones to train, or give")):
        tightfit.TrainStep(tightfit.plan(frozen, batch, loss=loss, device="cpu"), frozen, loss=loss)
    prompt = torch.nn.Parameter(torch.zeros(3))
    with_prompt = lambda model, b: ((model(b["x"] + prompt) - b["y"]) ** 2).mean()  # noqa: E731
    step = tightfit.TrainStep(tightfit.plan(frozen, batch, loss=with_prompt, device="cpu"), frozen,
                              torch.optim.SGD([prompt], lr=0.1), loss=with_prompt)
    assert step(batch).stepped and bool(prompt.detach().abs().sum() > 0)


def test_a_model_whose_forward_does_not_take_the_batchs_inputs_by_name_is_told_how():
    """A plain nn.Sequential given to a Workload failed at the first step with Python's own
    "Sequential.forward() got an unexpected keyword argument 'pixel_values'"; TrainStep said how
    to fix it, the Workload path did not. An error of the same words from inside a forward is
    left as it is."""
    from torch.utils.data import TensorDataset

    from tightfit.plan import Plan
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.tasks import ImageClassification
    from tightfit.workload import Workload, collate_as

    data = TensorDataset(torch.randn(16, 8), torch.arange(16) % 3)

    def fit(model):
        w = Workload(model, data, None, 8, task=ImageClassification(), collate_fn=collate_as("pixel_values", "labels"))
        Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1), progress=False).fit()

    with pytest.raises(TightfitError, match=re.escape("tightfit calls the model as model(**inputs) with the batch's "
                                                      "inputs by name (pixel_values); give it a forward that takes")):
        fit(torch.nn.Sequential(torch.nn.Linear(8, 3)))

    class Classifier(torch.nn.Sequential):  # its forward inherited: Python names "Sequential.forward"
        pass

    with pytest.raises(TightfitError, match=re.escape("tightfit calls the model as model(**inputs)")):
        fit(Classifier(torch.nn.Linear(8, 3)))

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Sequential(torch.nn.Linear(8, 3))

        def forward(self, pixel_values):
            return self.fc(x=pixel_values)  # the user's own mistake inside: Python's error, untouched

    with pytest.raises(TypeError, match=r"^Sequential\.forward\(\) got an unexpected keyword argument 'x'$"):
        fit(Inner())


def test_estimate_refuses_a_batch_without_labels_and_a_model_without_logits_in_one_line():
    """Its docstring promises a TightfitError for a malformed batch: a batch without labels raised
    KeyError: 'labels', a model returning a bare tensor AttributeError: no attribute 'logits'."""
    from tightfit.memory import estimate
    from tightfit.plan import Plan

    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(x)

    with pytest.raises(TightfitError, match=r"the example batch has no 'labels'"):
        estimate(Bare(), {"x": torch.randn(2, 8)}, Plan("fp32", 4, 4))
    with pytest.raises(TightfitError, match=r"the model returned Tensor, not an output with \.logits"):
        estimate(Bare(), {"x": torch.randn(2, 8), "labels": torch.zeros(2, dtype=torch.long)}, Plan("fp32", 4, 4))
