#include <stdio.h>

#include "cli/cli.h"
#include "quant/quant.h"

#define KVSERVE_VERSION "0.1.0"

int cli_version(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    printf("kvserve %s (kernels: %s)\n", KVSERVE_VERSION, quant_isa());
    return 0;
}
