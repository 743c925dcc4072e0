/* The pod sandbox's process (kubelet's "pause" image): it holds the pod's namespaces and reaps orphans
 * until it is told to stop. Built static by up.sh, since no registry is reachable to pull one. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction quit = {.sa_handler = stop}, child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &quit, NULL) < 0 || sigaction(SIGTERM, &quit, NULL) < 0 ||
      sigaction(SIGCHLD, &child, NULL) < 0)
    return 1;
  for (;;) pause();
}
