"""Which way the image travels (``image.transfer``, resolved into ``image.delivery``): the one
module that knows every way, so that none of the ways imports another (deploy/images/delivery.py)."""

from __future__ import annotations

from ..inventory import Inventory
from .chain import Chain
from .delivery import Delivery, Star
from .registry import Registry

WAYS: dict[str, type[Delivery]] = {c.name: c for c in (Star, Chain, Registry)}


def for_inventory(inv: Inventory) -> Delivery:
    """The way the inventory's image travels, ready to describe or ship."""
    return WAYS[inv.image.delivery](inv)
