#include "fu_err.h"

#include <stdarg.h>
#include <stdio.h>

static const struct {
    const char *name;
    const char *text;
} fu_err_table[FU_ERR_COUNT_] = {
    [FU_OK] = {"FU_OK", "success"},
    [FU_ENOMEM] = {"FU_ENOMEM", "out of memory or over a size budget"},
    [FU_EINVAL] = {"FU_EINVAL", "invalid argument"},
    [FU_EPROTO] = {"FU_EPROTO", "malformed or unexpected data"},
    [FU_ETIMEDOUT] = {"FU_ETIMEDOUT", "timed out"},
    [FU_EAUTH] = {"FU_EAUTH", "authentication or integrity check failed"},
    [FU_EDB] = {"FU_EDB", "database error"},
    [FU_EIO] = {"FU_EIO", "I/O error"},
    [FU_ECUDA] = {"FU_ECUDA", "CUDA error"},
    [FU_ENOTFOUND] = {"FU_ENOTFOUND", "not found"},
    [FU_EEXIST] = {"FU_EEXIST", "already exists"},
    [FU_EPERM] = {"FU_EPERM", "permission denied"},
    [FU_EVERSION] = {"FU_EVERSION", "unsupported version"},
    [FU_ENOSYS] = {"FU_ENOSYS", "not available in this build"},
    [FU_EAGAIN] = {"FU_EAGAIN", "resource temporarily unavailable"},
    [FU_ECANCELED] = {"FU_ECANCELED", "cancelled"},
};

const char *fu_strerror(fu_err err)
{
    if ((unsigned)err >= FU_ERR_COUNT_)
        return "unknown error";
    return fu_err_table[err].text;
}

const char *fu_errname(fu_err err)
{
    if ((unsigned)err >= FU_ERR_COUNT_)
        return "FU_EUNKNOWN";
    return fu_err_table[err].name;
}

fu_err fu_errmsg_set(fu_errmsg *em, fu_err err, const char *fmt, ...)
{
    if (em) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(em->msg, sizeof em->msg, fmt, ap);
        va_end(ap);
    }
    return err;
}

const char *fu_errmsg_text(const fu_errmsg *em, fu_err fallback)
{
    if (em && em->msg[0])
        return em->msg;
    return fu_strerror(fallback);
}
