"""A user's own pictures in: made to look like Fashion-MNIST, then classified by a trained run.

Fashion-MNIST's images are light garments on a black 28x28 canvas, the garment trimmed to its
bounding box and scaled so that its longest edge is 28 pixels. A photo is brought to that form:
grayscale, inverted when its background is light, trimmed, scaled (aspect kept) and centred.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from fashionjax import evaluate
from fashionjax.config import ConfigError

SIDE = 28
INK_FRACTION = 0.05  # a pixel belongs to the object when it stands out by 5% of the brightest (as the dataset trimmed)
BATCH = 256  # images per compiled call; the last batch is padded, so one shape compiles once


class ImageError(ValueError):
    """A file that is not a readable image (not an image at all, or truncated)."""


def image_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Every file named, and every file of every folder named (sorted, not recursive, hidden files
    left out): a file there that is not an image is reported like any other, not skipped in silence.
    Pipes are read only when named themselves: in a folder, one could block for ever."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
            if not files:
                raise ConfigError(f"{path}: no files in this folder")
            found += files
        elif path.exists():  # a file, or a pipe named on the command line: <(curl ...), /dev/stdin
            found.append(path)
        else:
            raise ConfigError(f"{path}: no such file or folder")
    return found


def load(path: str | Path) -> np.ndarray:
    """One image file as a (28, 28) uint8 Fashion-MNIST-style image; ImageError names a bad file."""
    try:
        # a pipe cannot seek, which decoders need: its bytes are read whole first
        source = path if Path(path).is_file() else io.BytesIO(Path(path).read_bytes())
        with Image.open(source) as image:
            image.load()  # decode now: a truncated file fails here, not later
            image = ImageOps.exif_transpose(image)  # a phone photo's orientation tag
            if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
                canvas = Image.new("RGBA", image.size, "white")  # transparent means background
                image = Image.alpha_composite(canvas, image.convert("RGBA"))
            gray = _gray_u8(image)
    except UnidentifiedImageError as err:  # its own text names a pipe's buffer, not the file
        raise ImageError(f"{path}: not a readable image (not in a picture format Pillow knows)") from err
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ImageError(f"{path}: not a readable image ({err})") from err
    return to_fashion_mnist(gray)


def _gray_u8(image: Image.Image) -> np.ndarray:
    """The picture's gray levels, 0-255. Pillow's own conversion clips a deep image (16-bit, 32-bit
    integer or float gray) at 255, which leaves it white; such an image is scaled from its full range:
    65,535 for 16 bits, 1.0 for a float image whose values stay within it (else 255, or its maximum)."""
    if not (image.mode in ("I", "F") or image.mode.startswith("I;16")):
        return np.asarray(image.convert("L"), dtype=np.uint8)
    values = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    highest = float(values.max(initial=0.0))
    if image.mode == "F" and highest <= 1.0:
        full = 1.0
    elif image.mode.startswith("I;16") or 255 < highest <= 65535:
        full = 65535.0
    else:
        full = max(255.0, highest)
    return np.round(np.clip(values / full, 0.0, 1.0) * 255.0).astype(np.uint8)


def to_fashion_mnist(gray: np.ndarray) -> np.ndarray:
    """A grayscale image (h, w) uint8 -> (28, 28) uint8, light object on black, as the dataset was made.

    An image that is already 28x28 on a dark background is returned unchanged: it is in the
    dataset's form (so the test set written to PNG classifies exactly as in memory).
    """
    light = _border_level(gray) > 127
    if gray.shape == (SIDE, SIDE) and not light:
        return gray.copy()
    ink = (255 - gray if light else gray).astype(np.float32)
    ink = np.clip(ink - _border_level(ink), 0, None)  # the background to black
    peak = float(ink.max())
    if peak <= 0:  # a blank picture: nothing to trim or scale
        return np.zeros((SIDE, SIDE), np.uint8)
    rows, cols = np.nonzero(ink > INK_FRACTION * peak)
    crop = ink[rows.min():rows.max() + 1, cols.min():cols.max() + 1] * (255.0 / peak)
    height, width = crop.shape
    scale = SIDE / max(height, width)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    resized = np.asarray(Image.fromarray(crop.astype(np.uint8)).resize(size, Image.Resampling.LANCZOS))
    canvas = np.zeros((SIDE, SIDE), np.uint8)
    top, left = (SIDE - size[1]) // 2, (SIDE - size[0]) // 2
    canvas[top:top + size[1], left:left + size[0]] = resized
    return canvas


def _border_level(image: np.ndarray) -> float:
    """The median of the outermost pixels: the background's level."""
    border = np.concatenate([image[0], image[-1], image[1:-1, 0], image[1:-1, -1]])
    return float(np.median(border))


def probabilities(classify, images_u8: np.ndarray) -> np.ndarray:
    """Class probabilities (n, 10) for images (n, 28, 28) uint8, in padded batches of one shape."""
    if not len(images_u8):
        return np.zeros((0, 10), np.float32)
    softmax = jax.jit(lambda images: jax.nn.softmax(classify(images)))
    return evaluate.in_fixed_batches(softmax, images_u8.astype(np.float32) / np.float32(255.0), BATCH)


@dataclasses.dataclass(frozen=True)
class Prediction:
    path: str
    image_u8: np.ndarray  # what the model saw
    probabilities: np.ndarray  # (10,)

    @property
    def blank(self) -> bool:
        """Nothing stood out from the background (one grey level): the class is the model's guess for an
        empty canvas, not about the picture."""
        return not self.image_u8.any()

    def to_dict(self, class_names: Sequence[str], top_k: int) -> dict:
        order = np.argsort(-self.probabilities, kind="stable")[:top_k]
        top = [{"label": int(k), "class": class_names[k], "probability": float(self.probabilities[k])}
               for k in order]
        return {"path": self.path, **top[0], "top_k": top, "blank": self.blank}


def predict(classify, paths: Iterable[Path]) -> tuple[list[Prediction], list[dict]]:
    """(predictions, failures): every readable image classified; each unreadable one named in failures."""
    loaded, failures = [], []
    for path in paths:
        try:
            loaded.append((str(path), load(path)))
        except ImageError as err:
            failures.append({"path": str(path), "message": str(err)})
    images_u8 = np.stack([image for _, image in loaded]) if loaded else np.zeros((0, SIDE, SIDE), np.uint8)
    probs = probabilities(classify, images_u8)
    return [Prediction(path, image, p) for (path, image), p in zip(loaded, probs, strict=True)], failures
