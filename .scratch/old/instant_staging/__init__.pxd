# The Cython face of instant_staging: ``from instant_staging cimport
# StagingBuffer`` gives another extension the buffer's pointer, size and
# registrations through nogil accessors (data(), nbytes(),
# n_registrations(), registration(i, &offset, &size)); see _staging.pxd.
from instant_staging._staging cimport StagingBuffer
