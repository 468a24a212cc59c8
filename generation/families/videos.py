"""Videos in: a video part as a [frames, H, W, 3] uint8 array (`video_frames`), video files decoded
with PyAV (`load_video`), and the settings of the model's video processor as transformers 4.57
reads them (`video_processor_config`).

    frames = video_frames(part_value, "conversations[0][1].content[0]")  # [T, H, W, 3] uint8

A video is given as
- a [frames, H, W, 3] uint8 array, taken as it is;
- a list of frames, each a PIL image (converted with convert("RGB")), an [H, W, 3] uint8 array,
  encoded image bytes or a path, stacked: all of one size, as transformers' make_batched_videos
  stacks a list of frames;
- a video file (its bytes, or a path), decoded with PyAV: every frame of its first video stream
  in order, each `frame.to_ndarray(format="rgb24")`, as transformers' `load_video(video,
  backend="pyav")` gives them with no num_frames or fps (all frames). PyAV is transformers' own
  default backend there, a wheel with FFmpeg's libraries inside (mp4/mov, webm/mkv, avi, mpeg-ts,
  ...); its probe takes only the container formats of VIDEO_FORMATS, and no demuxer may open
  another file or URL (a playlist that names one is refused), since a server decodes what clients
  send. (transformers' read_video_pyav keeps the first `stream.frames` frames, the container's
  count: every frame where the count is right; we decode every frame whatever it says.)

Limits, for every kind: MAX_VIDEO_FRAMES frames (generation.params.limits; Qwen2VLVideoProcessor's
max_frames) and MAX_VIDEO_BYTES bytes of RGB frames, checked frame by frame while decoding.

Preprocessing is Qwen2-VL's (`qwen2_vl.preprocess`, `images.qwen2vl_video_pixels`) with the
settings of transformers 4.57's Qwen2VLVideoProcessor, which Qwen2VLProcessor hands videos to:
min_pixels / max_pixels from the folder's video processor config (`video_processor_config`), each
frame resized with PIL's bicubic as Qwen2VLImageProcessor(videos=...) does. The 4.57 video
processor resizes with torchvision instead (uint8 antialiased bicubic: on the test model's frames
a few pixels differ by up to 3 of 255 from PIL's; its native uint8 path or its float fallback
depending on the CPU), so pixels match the slow image processor's exactly and the video
processor's to within those levels; grids, video tokens and positions are the processor's exactly.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

from ..params.limits import MAX_VIDEO_FRAMES
from . import module

MAX_VIDEO_BYTES = 256 * 2**20  # RGB bytes of one video's frames (frames * height * width * 3): 43 frames of 1080p

# FFmpeg demuxers a video file may be probed as (mp4/mov, matroska/webm, avi, mpeg-ps, mpeg-ts, ogg,
# flv, gif, asf/wmv); no protocol is allowed, so none of them opens another file or URL
VIDEO_FORMATS = "mov,matroska,avi,mpeg,mpegts,ogg,flv,gif,asf"

# Qwen2VLVideoProcessor's size when the folder gives none (not the image processor's 56*56, 28*28*1280)
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 28 * 28 * 768


def takes_videos(model) -> bool:
    """Whether the model's family takes videos (its module's VIDEOS: Qwen2-VL's does, Idefics3's
    does not)."""
    return bool(getattr(module(model.family), "VIDEOS", False))


def video_frames(video, name: str = "video", max_frames: int = MAX_VIDEO_FRAMES,
                 max_bytes: int = MAX_VIDEO_BYTES) -> np.ndarray:
    """A [frames, H, W, 3] uint8 array from a video array, a list of frames, or a video file
    (bytes, or a str / os.PathLike path); ValueError naming `name` for anything else, frames of
    different sizes, a file that does not decode, or a video past the limits."""
    if isinstance(video, np.ndarray):
        if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8 or not video.shape[0]:
            raise ValueError(f"{name}: a video array must be [frames, height, width, 3] uint8 with at least one "
                             f"frame, not {video.dtype} of shape {video.shape}")
        _check_size(len(video), video.nbytes, name, max_frames, max_bytes)
        return video
    if isinstance(video, (bytes, bytearray, str, os.PathLike)):
        return load_video(video, name, max_frames, max_bytes)
    if isinstance(video, (list, tuple)):
        if not video:
            raise ValueError(f"{name}: a video as a list of frames needs at least one frame")
        _check_size(len(video), 0, name, max_frames, max_bytes)
        frames, size = [], 0
        for k, frame in enumerate(video):
            frame = _frame(frame, f"{name}[{k}]")
            if frame.shape != (frames[0] if frames else frame).shape:
                raise ValueError(f"{name}[{k}]: the frames of a video must be of one size; this one is "
                                 f"{frame.shape[1]}x{frame.shape[0]}, frame 0 {frames[0].shape[1]}x{frames[0].shape[0]}")
            size += frame.nbytes
            _check_size(k + 1, size, name, max_frames, max_bytes)
            frames.append(frame)
        return np.stack(frames)
    raise ValueError(f"{name} must be a [frames, H, W, 3] uint8 array, a list of frames, or a video file "
                     f"(bytes or a path), not {type(video).__name__}")


def _frame(frame, name: str) -> np.ndarray:
    """One frame as an [H, W, 3] uint8 RGB array: a PIL image converted with convert("RGB") (as
    transformers' load_image), encoded bytes or a path decoded, an array taken as it is."""
    from .images import load_image

    frame = load_image(frame, name)
    if not isinstance(frame, np.ndarray):
        frame = np.asarray(frame.convert("RGB") if frame.mode != "RGB" else frame)
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        raise ValueError(f"{name}: a video frame must be an [height, width, 3] uint8 array, a PIL image, encoded image "
                         f"bytes or a path, not {frame.dtype} of shape {frame.shape}")
    return frame


def load_video(source, name: str = "video", max_frames: int = MAX_VIDEO_FRAMES,
               max_bytes: int = MAX_VIDEO_BYTES) -> np.ndarray:
    """Every frame of a video file (bytes, or a path) as a [frames, H, W, 3] uint8 RGB array,
    decoded with PyAV as transformers' load_video(backend="pyav") does; ValueError naming `name`
    for a file that does not decode, holds no video stream or is past the limits."""
    try:
        import av
    except ImportError:
        raise ValueError(f"{name}: video files need PyAV: pip install 'raymuter[video]'") from None
    if not isinstance(source, (bytes, bytearray)):
        try:
            source = Path(source).read_bytes()
        except OSError as e:
            raise ValueError(f"{name}: no readable video file {str(source)!r} ({type(e).__name__})") from None
    frames, size = [], 0
    try:
        with av.open(io.BytesIO(source), options={"format_whitelist": VIDEO_FORMATS, "protocol_whitelist": "none"}
                     ) as container:
            if not container.streams.video:
                raise ValueError(f"{name}: the file ({container.format.name}) holds no video stream")
            for frame in container.decode(container.streams.video[0]):
                size += frame.width * frame.height * 3
                _check_size(len(frames) + 1, size, name, max_frames, max_bytes)
                frames.append(frame.to_ndarray(format="rgb24"))
    except av.FFmpegError as e:
        raise ValueError(f"{name} is not a video file this server decodes ({', '.join(VIDEO_FORMATS.split(','))}): "
                         f"{type(e).__name__}: {e.strerror or e}") from None
    if not frames:
        raise ValueError(f"{name}: the video holds no frames")
    if len({f.shape for f in frames}) > 1:
        raise ValueError(f"{name}: the video's frames change size ({sorted({f.shape[:2] for f in frames})})")
    return np.stack(frames)


def _check_size(frames: int, size: int, name: str, max_frames: int, max_bytes: int) -> None:
    if frames > max_frames:
        raise ValueError(f"{name}: a video has at most {max_frames} frames; this one has more")
    if size > max_bytes:
        raise ValueError(f"{name}: a video's frames hold at most {max_bytes} bytes as RGB "
                         f"(frames * height * width * 3); this one's first {frames} hold {size}")


def video_processor_config(folder) -> dict:
    """The settings of the folder's video processor as transformers 4.57
    `Qwen2VLVideoProcessor.from_pretrained` reads them, as a config for images.Qwen2VLPixels: the
    first of video_preprocessor_config.json, preprocessor_config.json and processor_config.json
    (its "video_processor" entry where it has one); min_pixels / max_pixels where given, else
    size's shortest_edge / longest_edge, else 128*28*28 and 28*28*768; patch 14, temporal patch 2,
    merge 2 and the CLIP mean and std where it says nothing. do_sample_frames (off by default,
    and apply_chat_template turns it on only when given fps or num_frames) is not implemented.

    >>> import tempfile; folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "preprocessor_config.json").write_text('{"size": {"shortest_edge": 64, "longest_edge": 576}}')
    >>> {k: v for k, v in video_processor_config(folder).items() if k.endswith("pixels")}
    {'min_pixels': 64, 'max_pixels': 576}
    """
    folder, config, source = Path(folder), {}, "defaults"
    for source in ("video_preprocessor_config.json", "preprocessor_config.json", "processor_config.json"):
        if (folder / source).is_file():
            config = json.loads((folder / source).read_text())
            config = config.get("video_processor", config)
            break
    size = config.get("size") or {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS}
    bounds = {}
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        value = config.get(key)
        if value is None:
            if not isinstance(size, dict) or edge not in size:
                raise ValueError(f"{source}: size must hold shortest_edge and longest_edge (or give min_pixels and "
                                 f"max_pixels), not {size!r}")
            value = size[edge]
        bounds[key] = value
    if config.get("do_sample_frames"):
        raise ValueError(f"{source}: do_sample_frames is not implemented (videos run with all their frames)")
    return {**config, **bounds}
