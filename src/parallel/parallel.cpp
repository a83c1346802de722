// Entry points of parallel.h: validation on every rank and across ranks, then dispatch.
