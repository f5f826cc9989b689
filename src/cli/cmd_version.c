#include <stdio.h>

#include "cli/cli.h"

#define KVSERVE_VERSION "0.1.0"

int cli_version(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    printf("kvserve %s\n", KVSERVE_VERSION);
    return 0;
}
