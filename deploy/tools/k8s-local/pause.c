/* The pod sandbox's process (what Kubernetes' "pause" image runs): it holds the pod's namespaces,
 * reaps orphans when it is PID 1 of a shared PID namespace, and exits on SIGINT/SIGTERM.
 * Built static (gcc -Os -static) into the image tandem-pause:1.0 by images.sh. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int signo) { _exit(0); }

static void reap(int signo) {
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction on_stop = {.sa_handler = stop}, on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &on_stop, NULL) < 0 || sigaction(SIGTERM, &on_stop, NULL) < 0 ||
      sigaction(SIGCHLD, &on_child, NULL) < 0) {
    return 1;
  }
  for (;;) {
    pause();
  }
  return 42; /* never reached */
}
