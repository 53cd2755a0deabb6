/* fu_err: the one error enum of fusion. 0 is success; every fallible function returns an fu_err
 * (or NULL for constructors) and reports results through out-parameters. */
#ifndef FU_ERR_H
#define FU_ERR_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    FU_OK = 0,
    FU_ENOMEM,     /* out of memory, or a size budget was exceeded */
    FU_EINVAL,     /* invalid argument: bad shape, dtype, option or value */
    FU_EPROTO,     /* malformed or unexpected message or file content */
    FU_ETIMEDOUT,  /* a deadline passed */
    FU_EAUTH,      /* authentication or integrity check failed */
    FU_EDB,        /* database error */
    FU_EIO,        /* file or socket I/O error */
    FU_ECUDA,      /* CUDA or cuBLAS error */
    FU_ENOTFOUND,  /* a named thing (file, tensor, job, peer) does not exist */
    FU_EEXIST,     /* it exists already */
    FU_EPERM,      /* not allowed: ownership, file permissions */
    FU_EVERSION,   /* unsupported protocol, schema or file version */
    FU_ENOSYS,     /* not available in this build (for example no CUDA backend) */
    FU_EAGAIN,     /* try again later: no capacity, queue full */
    FU_ECANCELED,  /* the operation was cancelled */
    FU_ERR_COUNT_
} fu_err;

/* Short human-readable description of err ("out of memory"). Never NULL; static storage. */
const char *fu_strerror(fu_err err);

/* Stable machine name of err ("FU_ENOMEM"), for logs and the wire. Never NULL. */
const char *fu_errname(fu_err err);

#define FU_MUST_CHECK __attribute__((warn_unused_result))

/* Propagate a non-FU_OK result: FU_TRY(call()). */
#define FU_TRY(expr)                \
    do {                            \
        fu_err fu_try_rc_ = (expr); \
        if (fu_try_rc_ != FU_OK)    \
            return fu_try_rc_;      \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif
