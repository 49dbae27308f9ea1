"""Test doubles that stand in for components to come (a lever whose work overlaps compute: `stash`)."""
