/* fu_err: the one error enum of fusion, and fu_errmsg, the one way to carry an error's text. 0 is
 * success; every fallible function returns an fu_err (or NULL for constructors) and reports results
 * through out-parameters. */
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

/* Longest message an fu_errmsg keeps (longer ones are cut). */
#define FU_ERRMSG_MAX 1024

/* The one text channel that goes with an fu_err across modules: functions that can say more than
 * the code take an `fu_errmsg *em` as their last parameter and fill it on failure. em may always be
 * NULL (the caller does not want the text). The message names the thing that was wrong and where
 * ("model.safetensors: tensor 'x' has shape [2], expected [3]"), says what to do when there is
 * something to do, and carries no "fusion:" prefix: the program adds its own. */
typedef struct {
    char msg[FU_ERRMSG_MAX]; /* NUL-terminated; empty when nothing was reported */
} fu_errmsg;

/* Formats a message into em (if em is not NULL) and returns err, so that error paths read
 * `return fu_errmsg_set(em, FU_EPROTO, "%s: ...", file)`. */
fu_err fu_errmsg_set(fu_errmsg *em, fu_err err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* em's text, or fu_strerror(fallback) when em is NULL or empty. Never NULL. */
const char *fu_errmsg_text(const fu_errmsg *em, fu_err fallback);

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
