/* One progress line on a terminal, as `fusion wait`, `run finetune` and `upload` draw it:
 *
 *     [####........] 120/1000 loss 2.3104 812 tok/s 0:41 ETA 5:02  <tail>
 *
 * redrawn in place with \r, never wider than the terminal less one column (a line that wraps
 * scrolls the screen at every redraw), cut (not wrapped) when the terminal is narrow. The ETA counts
 * from the first progress seen, so time spent waiting for the job to start does not skew it. While
 * a line is open, anything else said on stderr (cli_progress_break) starts on a line of its own. */
#ifndef FUSION_CLI_PROGRESS_H
#define FUSION_CLI_PROGRESS_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    double start_s;    /* when following began: the elapsed time counts from here */
    double first_s;    /* when the first progress was seen (0: not yet): the ETA's rate counts from here */
    double first_done;
} cli_progress;

/* Starts the clocks now. */
void cli_progress_init(cli_progress *p);

/* Draws done of total (> 0) on stderr: the bar, count (e.g. "120/1000", the caller's units), detail
 * (e.g. "loss 2.31 812 tok/s"), the time followed, the ETA while done < total, then tail (may be
 * NULL). The line stays open. */
void cli_progress_draw(cli_progress *p, double done, double total, const char *count, const char *detail,
                       const char *tail);

/* Ends an open progress line (a newline), so that what follows starts at the left. Safe to call
 * when none is open. */
void cli_progress_break(void);

/* Erases an open progress line, so that a line can be printed in its place; the next draw puts it
 * back below. */
void cli_progress_clear(void);

#ifdef __cplusplus
}
#endif

#endif
