/* The progress line shared by the commands that follow long work (cli_progress.h). */
#include "cli_progress.h"

#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "fu_clock.h"

enum { BAR_WIDTH = 20 };

static bool g_line_open; /* a progress line is drawn on stderr and not ended */

/* Columns of the terminal on stderr (80 when it does not say). */
static int term_width(void)
{
    struct winsize ws;
    if (ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 20)
        return ws.ws_col;
    return 80;
}

/* "M:SS" or "H:MM:SS" of s seconds. */
static void fmt_duration(char *buf, size_t cap, double s)
{
    long t = s > 0 && s < 1e9 ? (long)(s + 0.5) : 0;
    if (t >= 3600)
        snprintf(buf, cap, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else
        snprintf(buf, cap, "%ld:%02ld", t / 60, t % 60);
}

void cli_progress_init(cli_progress *p)
{
    *p = (cli_progress){.start_s = fu_clock_sec()};
}

void cli_progress_draw(cli_progress *p, double done, double total, const char *count, const char *detail,
                       const char *tail)
{
    double now = fu_clock_sec();
    if (!p->first_s) {
        p->first_s = now;
        p->first_done = done;
    }
    char el[48], eta[64] = "";
    fmt_duration(el, sizeof el, now - p->start_s);
    if (done > p->first_done && done < total) {
        char t[48];
        fmt_duration(t, sizeof t, (total - done) * (now - p->first_s) / (done - p->first_done));
        snprintf(eta, sizeof eta, " ETA %s", t);
    }
    double frac = total > 0 ? done / total : 0;
    int filled = (int)(BAR_WIDTH * (frac < 0 ? 0 : frac > 1 ? 1 : frac));
    char bar[BAR_WIDTH + 1];
    for (int i = 0; i < BAR_WIDTH; i++)
        bar[i] = i < filled ? '#' : '.';
    bar[BAR_WIDTH] = '\0';
    char line[512];
    int n = snprintf(line, sizeof line, "[%s] %s%s%s %s%s%s%s", bar, count, detail && detail[0] ? " " : "",
                     detail ? detail : "", el, eta, tail && tail[0] ? "  " : "", tail ? tail : "");
    size_t max = (size_t)term_width() - 1;
    size_t len = n > 0 ? (size_t)n : 0;
    if (len > sizeof line - 1)
        len = sizeof line - 1;
    if (len > max) {
        len = max;
        while (len > 0 && ((unsigned char)line[len] & 0xC0) == 0x80) /* not inside a UTF-8 character */
            len--;
    }
    line[len] = '\0';
    fprintf(stderr, "\r%s\033[K", line);
    fflush(stderr);
    g_line_open = true;
}

void cli_progress_break(void)
{
    if (g_line_open)
        fputc('\n', stderr);
    g_line_open = false;
}

void cli_progress_clear(void)
{
    if (g_line_open)
        fputs("\r\033[K", stderr);
    g_line_open = false;
}
