"""Synthetic CT-like 3-D volumes and their organ label maps, for the chunked-array tests and benchmarks.

:func:`ct_volume` renders a volume that looks like a CT scan to a compressor and to a patch
sampler: outside the scanner's circular field of view the stored value is exactly 0 (as
scanners pad), air inside it about 24 (Hounsfield units offset by 1024), a body ellipsoid
(a fat layer ~930 around soft tissue ~1065), lungs (~170), liver, spleen and kidneys of
their own intensities (1110-1215, as after contrast), small lesions inside the organs, a spine of vertebrae
(cortical ~1900, cancellous ~1300) and discs, a ribcage-like bright shell, a smooth
multiplicative bias field (a scanner's cupping and drift, about 1-2 %), and Gaussian noise
of a few units. Values lie within 0-:data:`CT_MAX`, 12-bit CT stored as uint16.

:func:`label_volume` is the matching segmentation: 0 background, 1-6 the organs of
:data:`LABEL_NAMES`, and :data:`LESION_LABEL` for the lesions, a rare class (well under 1 %
of the voxels) so that a positive/negative patch sampler has something to find.
:func:`ct_pair` renders both in one pass. All three draw their geometry from
:func:`phantom`, so a label and the volume of the same (shape, seed) coincide voxel for voxel.

Axes are (z, y, x): axial slices along axis 0, anterior at small y, the patient's left at
large x (the radiological convention: the patient's right on the image's left). Every position and
size is a fraction of its axis, so anisotropic shapes such as (64, 256, 256) are the same
phantom at another sampling, and the same seed gives the same anatomy at any shape.
The output is a pure function of (shape, seed, dtype, noise_sigma). It is rendered in slabs
of :data:`_SLAB` slices, so a 512^3 uint16 volume needs its own 256 MiB and some tens of MiB
besides. numpy only: no OpenCV, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CT_MAX", "LABEL_NAMES", "LESION_LABEL", "Structure", "ct_pair", "ct_volume", "label_volume", "phantom",
]

#: the largest stored CT value (12-bit data in uint16, as scanners store it)
CT_MAX = 4095
_HU_OFFSET = 1024  # stored value = HU + 1024: air (-1000 HU) is 24, water (0 HU) 1024
#: label value -> name; 0 is everything unlabelled (air, fat, muscle, bone)
LABEL_NAMES = ("background", "lung_left", "lung_right", "liver", "spleen", "kidney_left", "kidney_right", "lesion")
#: the rare class, small ellipsoids inside the organs
LESION_LABEL = LABEL_NAMES.index("lesion")

#: slices rendered at once: bounds the float32 working memory whatever the volume's size; a
#: constant (not a parameter) because each slab's noise is drawn from its own seeded stream
_SLAB = 16
#: width, in voxels, of the soft edge of every structure (a reconstruction kernel's blur)
_EDGE = 1.0
_DTYPES = ("uint16", "int16", "float32")


@dataclass(frozen=True)
class Structure:
    """One ellipsoid of the phantom, in voxel coordinates of the requested shape.

    Attributes:
        name: what it stands for (``"liver"``, ``"rib_shell"``, ...).
        label: its value in :func:`label_volume` (0 for structures that are not labelled:
            painting one over an organ clears the organ's label there, as it hides it in the volume).
        intensity: stored value (HU + 1024) at its centre, before bias field and noise.
        centre: (z, y, x) in voxels.
        semi_axes: (z, y, x) semi-axes in voxels; ``inf`` along z for a cylinder through the volume.
        angle: rotation in the axial (y, x) plane, radians.
        hollow: inner/outer size ratio of a shell (0: solid).
        z_period: period in voxels of a banding along z (ribs, vertebrae; 0: none).
        z_duty: fraction of each period that the band covers.
        z_phase: offset of the banding in voxels.
        z_extent: (first, last) slice a cylinder spans (``inf`` semi-axis along z); ignored otherwise.
    """

    name: str
    label: int
    intensity: float
    centre: tuple[float, float, float]
    semi_axes: tuple[float, float, float]
    angle: float = 0.0
    hollow: float = 0.0
    z_period: float = 0.0
    z_duty: float = 1.0
    z_phase: float = 0.0
    z_extent: tuple[float, float] = (-math.inf, math.inf)


def _check_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    if len(shape) != 3 or any(int(n) < 8 for n in shape):
        raise ValueError(f"shape must be (z, y, x), each >= 8, got {tuple(shape)!r}")
    nz, ny, nx = (int(n) for n in shape)
    return nz, ny, nx


def phantom(shape: Sequence[int] = (128, 128, 128), seed: int = 0) -> list[Structure]:
    """The phantom's structures in painting order (later ones cover earlier ones).

    The geometry shared by :func:`ct_volume` and :func:`label_volume`: every draw is a
    fraction of an axis, so a seed describes the same anatomy at any shape.

    Args:
        shape (Sequence[int]): (z, y, x) of the volume, each >= 8.
        seed (int): the anatomy (sizes, positions, intensities) is a pure function of it.

    Returns:
        list[Structure]: body, lungs, bones, organs, then lesions.
    """
    nz, ny, nx = _check_shape(shape)
    rng = np.random.default_rng([seed, 0xC7B0D7])

    def u(lo: float, hi: float) -> float:
        return float(rng.uniform(lo, hi))

    out: list[Structure] = []
    cz, cy, cx = nz * u(0.48, 0.52), ny * u(0.47, 0.53), nx * u(0.47, 0.53)
    # the body spans every slice, tapering towards the ends (shoulders, pelvis)
    bz, by, bx = nz * u(0.9, 1.05), ny * u(0.3, 0.36), nx * u(0.38, 0.44)
    tilt = math.radians(u(-4, 4))
    fat = u(0.05, 0.09)  # subcutaneous fat, as a fraction of the body's axes
    out.append(Structure("fat", 0, _HU_OFFSET + u(-110, -80), (cz, cy, cx), (bz, by, bx), tilt))
    out.append(Structure("soft_tissue", 0, _HU_OFFSET + u(35, 45), (cz, cy, cx),
                         (bz * (1 - fat), by * (1 - fat), bx * (1 - fat)), tilt))
    # lungs in the upper (chest) part, organs below: a chest-abdomen scan
    for label, side in ((1, 1), (2, -1)):
        out.append(Structure(LABEL_NAMES[label], label, _HU_OFFSET + u(-870, -820),
                             (nz * u(0.22, 0.28), cy - by * u(0.0, 0.08), cx + side * bx * u(0.38, 0.44)),
                             (nz * u(0.18, 0.24), by * u(0.5, 0.62), bx * u(0.28, 0.34)), math.radians(u(-10, 10))))
    # ribs: a thin elliptic tube inside the body wall, banded along z, over the chest only
    ring = 1 - fat - u(0.08, 0.11)
    out.append(Structure("rib_shell", 0, _HU_OFFSET + u(700, 1000), (cz, cy, cx), (math.inf, by * ring, bx * ring),
                         tilt, hollow=1 - u(0.06, 0.09), z_period=nz * u(0.06, 0.08), z_duty=0.4,
                         z_phase=nz * u(0, 0.05), z_extent=(nz * u(0.03, 0.06), nz * u(0.5, 0.56))))
    # spine: discs everywhere, vertebrae (cortical shell, cancellous core) banded along z
    sy, sx = cy + by * u(0.6, 0.66), cx + bx * u(-0.02, 0.02)
    vy, vx = by * u(0.13, 0.16), bx * u(0.09, 0.11)
    period, phase = nz * u(0.09, 0.11), nz * u(0, 0.1)
    out.append(Structure("disc", 0, _HU_OFFSET + u(70, 90), (cz, sy, sx), (math.inf, vy, vx)))
    out.append(Structure("vertebra_cortex", 0, _HU_OFFSET + u(800, 1100), (cz, sy, sx), (math.inf, vy, vx),
                         z_period=period, z_duty=0.8, z_phase=phase))
    out.append(Structure("vertebra_core", 0, _HU_OFFSET + u(220, 320), (cz, sy, sx), (math.inf, vy * 0.7, vx * 0.7),
                         z_period=period, z_duty=0.7, z_phase=phase))
    # contrast-enhanced (portal venous) values, so that every organ stands out from soft tissue
    organs = [
        # name, label, HU range, centre, semi-axes: z as a fraction of the volume, y and x of the
        # body's semi-axes (the centre from the body's centre)
        ("liver", 3, (90, 105), (0.56, -0.08, -0.35), (0.15, 0.42, 0.32)),
        ("spleen", 4, (110, 125), (0.58, 0.15, 0.5), (0.09, 0.22, 0.14)),
        ("kidney_left", 5, (160, 190), (0.76, 0.4, 0.38), (0.08, 0.16, 0.1)),
        ("kidney_right", 6, (160, 190), (0.76, 0.4, -0.38), (0.08, 0.16, 0.1)),
    ]
    for name, label, (hu_lo, hu_hi), (fz, fy, fx), (az, ay, ax) in organs:
        jitter = [u(0.9, 1.1) for _ in range(3)]
        centre = (nz * (fz + u(-0.03, 0.03)), cy + by * (fy + u(-0.04, 0.04)), cx + bx * (fx + u(-0.04, 0.04)))
        out.append(Structure(name, label, _HU_OFFSET + u(hu_lo, hu_hi), centre,
                             (nz * az * jitter[0], by * ay * jitter[1], bx * ax * jitter[2]), math.radians(u(-25, 25))))
    # lesions: 1-3 small ellipsoids, each in its own organ (two in one small kidney could overlap
    # and cancel out), darker or brighter than it; half-axes of at least 1.5 voxels so that even a
    # small volume keeps them
    organ_structures = [s for s in out if 3 <= s.label <= 6]
    for host_index in rng.choice(len(organ_structures), size=int(rng.integers(1, 4)), replace=False):
        host = organ_structures[int(host_index)]
        offset = [u(-0.3, 0.3) * a for a in host.semi_axes]
        radius = u(0.025, 0.045)
        contrast = u(-60, -35) if rng.random() < 0.5 else u(50, 90)
        out.append(Structure("lesion", LESION_LABEL, host.intensity + contrast,
                             (host.centre[0] + offset[0], host.centre[1] + offset[1], host.centre[2] + offset[2]),
                             (max(1.5, nz * radius), max(1.5, ny * radius * u(0.8, 1.2)),
                              max(1.5, nx * radius * u(0.8, 1.2)))))
    return out


def _weight(s: Structure, z0: int, z1: int, ny: int, nx: int) -> tuple[tuple[slice, slice, slice], np.ndarray] | None:
    """The structure's coverage (0..1, soft edge) over slices z0..z1, cropped to its bounding box.

    Returns ``(index, weight)`` with ``weight`` the shape of ``volume[z0:z1][index]``, or None
    when the structure misses the slab.
    """
    cz, cy, cx = s.centre
    az, ay, ax = s.semi_axes
    cos, sin = math.cos(s.angle), math.sin(s.angle)
    margin = 2 * _EDGE
    half_y = math.hypot(ay * cos, ax * sin) + margin
    half_x = math.hypot(ay * sin, ax * cos) + margin
    if math.isfinite(az):
        zlo, zhi = max(z0, math.floor(cz - az - margin)), min(z1, math.ceil(cz + az + margin) + 1)
    else:
        first, last = s.z_extent
        zlo = z0 if first == -math.inf else max(z0, math.ceil(first))
        zhi = z1 if last == math.inf else min(z1, math.floor(last) + 1)
    ylo, yhi = max(0, math.floor(cy - half_y)), min(ny, math.ceil(cy + half_y) + 1)
    xlo, xhi = max(0, math.floor(cx - half_x)), min(nx, math.ceil(cx + half_x) + 1)
    if zlo >= zhi or ylo >= yhi or xlo >= xhi:
        return None
    dy = (np.arange(ylo, yhi, dtype=np.float32) - np.float32(cy))[:, None]
    dx = (np.arange(xlo, xhi, dtype=np.float32) - np.float32(cx))[None, :]
    # the in-plane part of the quadratic form is computed once per slab; z only adds a 1-D term
    along, across = cos * dy + sin * dx, cos * dx - sin * dy
    q2 = (along / np.float32(ay)) ** 2 + (across / np.float32(ax)) ** 2
    dz = np.arange(zlo, zhi, dtype=np.float32) - np.float32(cz)
    qz = (dz / np.float32(az)) ** 2 if math.isfinite(az) else np.zeros_like(dz)
    q = q2[None, :, :] + qz[:, None, None]
    # (1 - r) * smallest semi-axis approximates the distance to the surface in voxels, which
    # gives every structure the same soft edge whatever its size
    scale = np.float32(min(a for a in (az, ay, ax) if math.isfinite(a)) / _EDGE)
    w = np.sqrt(q, out=q)
    np.subtract(1.0, w, out=w)
    w *= scale
    w += 0.5
    np.clip(w, 0.0, 1.0, out=w)
    if s.hollow:
        inner = np.sqrt(q2[None, :, :] + qz[:, None, None]) / np.float32(s.hollow)
        np.subtract(1.0, inner, out=inner)
        inner *= scale * s.hollow
        inner += 0.5
        np.clip(inner, 0.0, 1.0, out=inner)
        w *= 1.0 - inner
    if s.z_period:
        # a smooth band: cos above the threshold that leaves z_duty of each period inside
        phase = 2 * np.pi * (np.arange(zlo, zhi, dtype=np.float32) - np.float32(s.z_phase)) / np.float32(s.z_period)
        threshold = math.cos(math.pi * s.z_duty)
        sharp = s.z_period / (2 * np.pi * _EDGE)  # about one voxel of transition
        band = np.clip((np.cos(phase) - threshold) * np.float32(sharp) + 0.5, 0.0, 1.0)
        w *= band[:, None, None]
    return (slice(zlo - z0, zhi - z0), slice(ylo, yhi), slice(xlo, xhi)), w


def _bias(nz: int, ny: int, nx: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A smooth multiplicative field, as a z factor (nz,) and an in-plane factor (ny, nx):
    a slight linear drift along each axis and the cupping of beam hardening (darker centre)."""
    gz, gy, gx = (float(g) for g in rng.uniform(-0.015, 0.015, 3))
    cup = float(rng.uniform(0.01, 0.02))
    z = np.linspace(-0.5, 0.5, nz, dtype=np.float32)
    y = np.linspace(-0.5, 0.5, ny, dtype=np.float32)[:, None]
    x = np.linspace(-0.5, 0.5, nx, dtype=np.float32)[None, :]
    plane = 1.0 + gy * y + gx * x - cup * (0.5 - (y * y + x * x))
    return (1.0 + gz * z).astype(np.float32), plane.astype(np.float32)


def _render(shape: Sequence[int], seed: int, dtype: str | None, noise_sigma: float,
            want_label: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
    nz, ny, nx = _check_shape(shape)
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if not noise_sigma >= 0:
        raise ValueError(f"noise_sigma must be >= 0, got {noise_sigma!r}")
    structures = phantom((nz, ny, nx), seed)
    volume = np.empty((nz, ny, nx), np.dtype(dtype)) if dtype is not None else None
    label = np.zeros((nz, ny, nx), np.uint8) if want_label else None
    bias_z, bias_plane = _bias(nz, ny, nx, np.random.default_rng([seed, 0xB1A5]))
    # the scanner's field of view: a disc inscribed in the axial plane; stored 0 outside
    fy = (np.arange(ny, dtype=np.float32) - (ny - 1) / 2) / (ny / 2)
    fx = (np.arange(nx, dtype=np.float32) - (nx - 1) / 2) / (nx / 2)
    outside_fov = (fy[:, None] ** 2 + fx[None, :] ** 2) > 1.0
    for z0 in range(0, nz, _SLAB):
        z1 = min(nz, z0 + _SLAB)
        slab = np.full((z1 - z0, ny, nx), _HU_OFFSET - 1000, np.float32) if volume is not None else None
        for s in structures:
            hit = _weight(s, z0, z1, ny, nx)
            if hit is None:
                continue
            index, w = hit
            if slab is not None:
                # blend towards the structure's intensity in proportion to its coverage
                view = slab[index]
                view += w * (np.float32(s.intensity) - view)
            if label is not None:
                label[z0:z1][index][w >= 0.5] = s.label
        if volume is None or slab is None:
            continue
        slab *= bias_plane[None, :, :]
        slab *= bias_z[z0:z1, None, None]
        if noise_sigma > 0:
            # one stream per slab (the slab size is fixed), so the bytes do not depend on anything else
            noise = np.random.default_rng([seed, z0 // _SLAB, 0x4015E]).standard_normal(slab.shape, np.float32)
            noise *= np.float32(noise_sigma)
            slab += noise
        slab[:, outside_fov] = 0.0
        if dtype == "float32":
            volume[z0:z1] = slab
            continue
        np.rint(slab, out=slab)
        np.clip(slab, 0, CT_MAX, out=slab)
        if dtype == "int16":
            slab -= _HU_OFFSET  # Hounsfield units, as DICOM readers return them after the rescale
        volume[z0:z1] = slab
    if label is not None:
        label[:, outside_fov] = 0
    return volume, label


def ct_volume(shape: Sequence[int] = (128, 128, 128), seed: int = 0, dtype: str = "uint16",
              noise_sigma: float = 5.0) -> np.ndarray:
    """A CT-like volume (see the module docstring for its anatomy).

    Args:
        shape (Sequence[int]): (z, y, x), each >= 8; anisotropic shapes are the same anatomy.
        seed (int): the volume is a pure function of (shape, seed, dtype, noise_sigma).
        dtype (str): ``"uint16"``: stored values HU + 1024 within 0-:data:`CT_MAX`, as scanners
            write them; ``"int16"``: Hounsfield units (the same values minus 1024, -1024 outside
            the field of view); ``"float32"``: the stored values before rounding and clipping.
        noise_sigma (float): standard deviation of the Gaussian noise in stored units (0: none).

    Returns:
        numpy.ndarray: shape ``shape``, dtype ``dtype``.
    """
    volume, _ = _render(shape, seed, dtype, noise_sigma, want_label=False)
    assert volume is not None
    return volume


def label_volume(shape: Sequence[int] = (128, 128, 128), seed: int = 0) -> np.ndarray:
    """The organ labels of :func:`ct_volume` of the same (shape, seed).

    A voxel takes the label of the last structure of :func:`phantom` that covers at least
    half of it (bone and tissue painted later clear it to 0, as they hide the organ).

    Args:
        shape (Sequence[int]): (z, y, x), each >= 8.
        seed (int): the same seed as the volume's.

    Returns:
        numpy.ndarray: uint8 of shape ``shape``: 0 background, 1-6 organs (:data:`LABEL_NAMES`),
        :data:`LESION_LABEL` for the lesions.
    """
    _, label = _render(shape, seed, None, 0.0, want_label=True)
    assert label is not None
    return label


def ct_pair(shape: Sequence[int] = (128, 128, 128), seed: int = 0, dtype: str = "uint16",
            noise_sigma: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """A volume and its labels, rendered in one pass: ``(ct_volume(...), label_volume(shape, seed))``.

    Args:
        shape (Sequence[int]): (z, y, x), each >= 8.
        seed (int): the pair is a pure function of its arguments.
        dtype (str): as for :func:`ct_volume`.
        noise_sigma (float): as for :func:`ct_volume`.

    Returns:
        tuple[numpy.ndarray, numpy.ndarray]: the volume (``dtype``) and the labels (uint8).
    """
    volume, label = _render(shape, seed, dtype, noise_sigma, want_label=True)
    assert volume is not None and label is not None
    return volume, label
