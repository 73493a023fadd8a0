#include <xnnpack.h>
