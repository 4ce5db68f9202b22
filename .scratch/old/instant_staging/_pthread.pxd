"""The few POSIX thread calls the package's C threads use (prefault, loader).

Cython's own ``posix`` package has no pthread.h; these are the declarations
both ``_staging.pyx`` and ``_pipeline.pyx`` cimport.
"""

from posix.time cimport timespec

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_create(pthread_t* thread, void* attr, void* (*start)(void*) noexcept nogil, void* arg)
    int pthread_join(pthread_t thread, void** retval)
    int pthread_mutex_init(pthread_mutex_t* m, void* attr)
    int pthread_mutex_destroy(pthread_mutex_t* m)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)
    int pthread_cond_init(pthread_cond_t* c, void* attr)
    int pthread_cond_destroy(pthread_cond_t* c)
    int pthread_cond_broadcast(pthread_cond_t* c)
    int pthread_cond_wait(pthread_cond_t* c, pthread_mutex_t* m)
    int pthread_cond_timedwait(pthread_cond_t* c, pthread_mutex_t* m, const timespec* t)
