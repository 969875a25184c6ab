package dev.tolk.registry;

import io.apicurio.common.apps.config.DynamicConfigPropertyList;
import java.util.List;
import javax.enterprise.context.ApplicationScoped;
import javax.enterprise.inject.Produces;

/**
 * The bean apicurio-common-app-components-config-index's build step would make (the registry's
 * settings that may change at run time, found by annotation scanning): that extension's
 * deployment module is not served by Maven Central, so the list is empty and every setting
 * keeps the value it starts with.
 */
@ApplicationScoped
public class DynamicConfigDefaults {
  @Produces
  @ApplicationScoped
  DynamicConfigPropertyList dynamicConfigProperties() {
    return new DynamicConfigPropertyList(List.of());
  }
}
