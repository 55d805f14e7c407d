"""A --trainable that the image model cannot take is refused from its config, before the images are
decoded (review): frozen-99 and lora on a small ResNet came after every image was opened, so a
corrupt image (or thousands of photos decoded for nothing) came first."""

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from tightfit.cli import main  # noqa: E402


def _folder_with_a_corrupt_image(root):
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(12):
            Image.fromarray((rng.random((20, 20, 3)) * 255).astype(np.uint8)).save(root / c / f"{i}.png")
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(root / "a" / "x.jpg")
    data = (root / "a" / "x.jpg").read_bytes()
    (root / "a" / "x.jpg").write_bytes(data[: len(data) // 2])  # truncated: decoding fails
    return root


def _resnet(path):
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                              layer_type="basic")).save_pretrained(path)
    return path


@pytest.mark.parametrize("trainable, said", [("frozen-99", "freeze at most"), ("lora", "no repeated blocks")])
def test_a_trainable_the_image_model_cannot_take_is_refused_before_the_images_are_decoded(tmp_path, capsys,
                                                                                          trainable, said):
    data = _folder_with_a_corrupt_image(tmp_path / "data")
    model = _resnet(tmp_path / "m")
    capsys.readouterr()
    code = main(["train", "--data", str(data), "--model", str(model), "--image-size", "16", "--device", "cpu",
                 "--trainable", trainable, "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert said in err and "not a readable image" not in err, err
    assert not (tmp_path / "run").exists()
