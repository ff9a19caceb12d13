"""Box images: what a box's root is (``host``, a root directory, or an OCI image).

:func:`resolve_image` maps a ref to a :class:`ResolvedImage`; the image store
(:mod:`corral.images.store`) keeps OCI images unpacked and shared by layer.
"""

from corral.images.resolve import ImageConfig, ResolvedImage, resolve_image, resolve_root

__all__ = ["ImageConfig", "ResolvedImage", "resolve_image", "resolve_root"]
