"""One file per decoder family; each defines FAMILY."""
