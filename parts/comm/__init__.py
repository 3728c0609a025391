"""The communication layer below every part: object exchange (more to come: group handles, byte counter)."""

from parts.comm.objects import all_gather_objects, broadcast_object

__all__ = ["all_gather_objects", "broadcast_object"]
